"""`python -m inference.training_bench`: the code lives in `inference/measure/pipeline/training_bench.py`."""

from inference.measure.pipeline.training_bench import main

if __name__ == "__main__":
    main()
