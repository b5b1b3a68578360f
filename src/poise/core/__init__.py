"""The shared vocabulary every other package speaks: the cluster (`cluster`), the model's shape
(`spec`), where experts live and where tokens go (`placement`), errors (`errors`) and the parsing of
configuration fields (`fields`). NumPy only; imports nothing else of Poise."""
