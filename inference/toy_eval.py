"""`python -m inference.toy_eval`: the code lives in `inference/evaluation/toy_eval.py`."""

from inference.evaluation.toy_eval import main

if __name__ == "__main__":
    main()
