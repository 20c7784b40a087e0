"""`python -m provision`: the command line."""
from .cli import main

main()
