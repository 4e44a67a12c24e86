"""`python -m inference.world_calibrate`: the code lives in `inference/measure/world_calibrate.py`."""

from inference.measure.world_calibrate import main

if __name__ == "__main__":
    main()
