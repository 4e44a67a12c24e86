"""`python -m inference.data_bench`: the code lives in `inference/measure/pipeline/data_bench.py`."""

from inference.measure.pipeline.data_bench import main

if __name__ == "__main__":
    main()
