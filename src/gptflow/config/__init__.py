"""What a run is: the config's schema and YAML (:mod:`gptflow.config.schema`) and the model and
training settings as frozen dataclasses with their derived numbers
(:mod:`gptflow.config.settings`). Imports only the top-level leaves."""
