"""`python -m aotfuse`: the same command line as `aotfuse`."""
from aotfuse.cli import main

if __name__ == "__main__":
    main()
