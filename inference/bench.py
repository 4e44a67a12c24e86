"""`python -m inference.bench`: the code lives in `inference/measure/bench.py`."""

from inference.measure.bench import main

if __name__ == "__main__":
    main()
