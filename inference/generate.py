"""`python -m inference.generate`: the code lives in `inference/decoding/generate.py`."""

from inference.decoding.generate import main

if __name__ == "__main__":
    main()
