"""`python -m specdec_tools.distill ...`: see specdec_tools.distill.cli."""
from specdec_tools.distill.cli import main

if __name__ == "__main__":
    main()
