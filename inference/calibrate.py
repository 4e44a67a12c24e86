"""`python -m inference.calibrate`: the code lives in `inference/decoding/calibrate.py`."""

from inference.decoding.calibrate import main

if __name__ == "__main__":
    main()
