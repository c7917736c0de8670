"""Built-in models, each a `model.entry` like any user's (`diloco.models.transformer:spec`)."""
