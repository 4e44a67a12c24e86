"""`python -m inference.decoding_table`: the code lives in `inference/measure/decoding_table.py`."""

from inference.measure.decoding_table import main

if __name__ == "__main__":
    main()
