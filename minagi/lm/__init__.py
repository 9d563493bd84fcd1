"""minagi.lm: the byte-level language model built on minagi.moe: the model and its pool of experts,
typed configs and profiles, data, the trainer, the writer and the command line."""
