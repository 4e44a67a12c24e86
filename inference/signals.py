"""`python -m inference.signals`: the code lives in `inference/measure/signals.py`."""

from inference.measure.signals import main

if __name__ == "__main__":
    main()
