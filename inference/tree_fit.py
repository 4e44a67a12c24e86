"""`python -m inference.tree_fit`: the code lives in `inference/measure/tree_fit.py`."""

from inference.measure.tree_fit import main

if __name__ == "__main__":
    main()
