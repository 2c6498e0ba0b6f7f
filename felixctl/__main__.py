"""``python -m felixctl``."""

from felixctl.cli import main

if __name__ == "__main__":
    main()
