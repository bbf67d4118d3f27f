"""What a run reads: prompt datasets and their mixing, reward sources (a function file, an HTTP server, reward
model heads) and the reward server (`orlhf serve-rm`)."""
