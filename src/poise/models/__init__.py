"""Models built from `poise.nn` layers: the GPT-MoE that `poise train` trains (`gpt`).

from poise.models.gpt import GPTMoE, model_config
model = GPTMoE(model_config("tiny"))
"""
