"""The built-in tiny demo: a model and tokenizer built locally, a prompt set, its reward function and a multi-turn
agent. reward.py and agent.py are templates a user copies: they import orlhf as a user file would."""
