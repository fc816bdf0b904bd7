"""What train.py needs besides its outline: train.py reads top to bottom (set up, build, loop,
save), and these modules hold its steps.

config.py   TrainConfig: the run's settings, one dataclass per concern, each field with its doc and check
sources.py  where the shipped demo base and the model shapes of configs/ are
run.py      the run's setup (seed, layout, refusals), resume, and stopping on a non-finite loss
model.py    the model (loaded, LoRA, patched, FSDP2, compiled) and its optimizer and schedule
batches.py  the data: rows, each micro-batch's rows (a pure function of its index), this rank's shard
report.py   the log of each step, the run's summary, and the saved model
"""
