"""`python -m inference.results`: the code lives in `inference/measure/results.py`."""

from inference.measure.results import main

if __name__ == "__main__":
    main()
