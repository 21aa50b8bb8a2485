"""Where model files come from: the loader every role uses, and the built-in models made locally and cached."""
