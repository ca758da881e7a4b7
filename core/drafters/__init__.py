"""Everything that proposes tokens for the base model to verify.

- `interface`: the drafter protocol (`Drafter`, `DraftContext`, `HeadProposal`, `Chain`) and the
  adapters the decoder calls; bf16 drafting under an fp32 base where bf16 is fast;
- `medusa`: Medusa heads (one residual block per head, a draft-vocabulary projection);
- `hydra`: Hydra heads (each head sees the path drafted so far) and the tree they grow;
- `lookup`: prompt lookup (n-gram matches in the prompt and the text so far);
- `datastore`: a retrieval store of token n-grams (REST-style) shipped in assets.
"""
