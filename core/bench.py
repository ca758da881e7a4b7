"""`python -m core.bench`: the benchmark's command line (the public contract).

The benchmark itself is offline work (offline/bench.py); this entry point runs it as a script,
so nothing under core/ imports the offline package.
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("offline.bench", run_name="__main__", alter_sys=True)
