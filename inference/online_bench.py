"""`python -m inference.online_bench`: the code lives in `inference/measure/pipeline/online_bench.py`."""

from inference.measure.pipeline.online_bench import main

if __name__ == "__main__":
    main()
