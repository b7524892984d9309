"""gptflow: raw text to a trained GPT checkpoint, as one cached, resumable Snakemake workflow."""

__version__ = "0.1.0"
