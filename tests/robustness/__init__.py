"""Robustness tests by subject: lifecycle, state dicts, kept casts, contexts,
gradients, threads, numerical edges, loss scaling, misuse, atomic quantize,
unusual modules, Keras compatibility and Hugging Face models. Each module's
docstring states its contract; builders and checks are in `helpers`."""
