"""One batch on one plan: splitting the batch, forward and backward per micro-batch, clip, step."""
