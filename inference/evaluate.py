"""`python -m inference.evaluate`: the code lives in `inference/evaluation/evaluate.py`."""

from inference.evaluation.evaluate import main

if __name__ == "__main__":
    main()
