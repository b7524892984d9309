"""Training: ``gptflow train`` and everything it is made of. Imports the leaves, config/,
data/ and container/ (a task's launch inside the image); nothing here imports results/ or plan/.

The package, in the order a run meets it:

- :mod:`gptflow.train.run_config` -- ``results/runs/{run}/run.yaml``, what ``gptflow train``
  reads, rendered from the workflow config; the data index it builds;
- :mod:`gptflow.train.main` -- ``gptflow train``: set up the rank, take the run's lock, run the
  loop; :mod:`gptflow.train.launch` -- ``--nproc-per-node``: the ranks of one machine through
  PyTorch's elastic launcher, exit code 75 kept;
- :mod:`gptflow.train.distributed` -- rank, world and master from Slurm's or torchrun's
  environment, the launch lines; :mod:`gptflow.train.device` -- the rank's device, the process
  group, the loop's tensors;
- :mod:`gptflow.train.model` -- the GPT-NeoX network; :mod:`gptflow.train.model_parallel` --
  tensor and pipeline parallel, the model split over ranks; :mod:`gptflow.train.engine` --
  DeepSpeed around it (ZeRO, the optimizers); :mod:`gptflow.train.init_from` -- step 0 from
  a Hugging Face checkpoint; :mod:`gptflow.train.kfac` -- the K-FAC preconditioner;
- :mod:`gptflow.train.loop` -- resume, then for each step: batches -> forward/backward/step ->
  log -> eval -> save, each a short function; :mod:`gptflow.train.metrics` -- the log
  interval's sums, the iteration line, metrics.jsonl, tokens/s, TFLOP/s and MFU;
- :mod:`gptflow.train.checkpoint` -- saves, resume, retention, the run lock;
  :mod:`gptflow.train.async_save` -- a save's files taken into host memory and written by a
  thread per rank.

This file imports nothing: planning imports :mod:`gptflow.train.distributed` and must not pull
torch in with it.
"""
