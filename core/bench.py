"""`python -m core.bench`: the benchmark's command line (the public contract), run by offline.bench."""
from offline.bench import main

if __name__ == "__main__":
    main()
