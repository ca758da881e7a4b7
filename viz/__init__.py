"""Pure views of decoding steps: StepRecords / TreeOutcomes in, plotly figures and HTML out.

Nothing here loads or runs a model, and nothing imports gradio. Core types are only used
for type hints, so `viz` imports without torch-heavy work at runtime.
"""
