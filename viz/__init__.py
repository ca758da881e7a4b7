"""Pure views of decoding steps: StepRecords / TreeOutcomes in, plotly figures and HTML out.

Nothing here loads or runs a model, and nothing imports gradio. From core only `core.records`
is used (its dataclasses for type hints, its strategy-name constants); token bytes, when a view
needs them to show whole characters, are passed in as a plain id -> bytes mapping.
"""
