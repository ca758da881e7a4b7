"""The sizes a decode may take: node budget, top-m, depth, new tokens, grafted chains, and the rows one
verify can hold (the engine sizes its cache by them). A leaf: imports nothing of the project."""
MAX_BUDGET = 256
MAX_TOP_M = 64
MAX_DEPTH = 16  # no model here has more heads
MAX_NEW_TOKENS = 1024
MAX_CHAIN_TOKENS = 32  # prompt-lookup chain and datastore branch length
MAX_CHAINS = 8  # prompt-lookup chains, and datastore branches, grafted onto one tree
# the most rows one verify can hold: the root, the node budget, and every grafted chain in full
MAX_TREE_ROWS = 1 + MAX_BUDGET + 2 * MAX_CHAINS * MAX_CHAIN_TOKENS
