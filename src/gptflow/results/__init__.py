"""After training: the jobs' sizes (:mod:`~gptflow.results.sizing`), evaluation, the Hugging Face
export, lm-evaluation-harness, the run card and plots, a study's comparison and its scaling-law
fits. Imports the leaves, config/, data/ and train/."""
