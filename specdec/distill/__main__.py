"""`python -m specdec.distill ...`: see specdec.distill.cli."""
from specdec.distill.cli import main

if __name__ == "__main__":
    main()
