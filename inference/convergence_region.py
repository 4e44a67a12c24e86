"""`python -m inference.convergence_region`: the code lives in `inference/measure/pipeline/convergence_region.py`."""

from inference.measure.pipeline.convergence_region import main

if __name__ == "__main__":
    main()
