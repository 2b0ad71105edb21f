"""What a save captures: the training state of every kind of model, optimizer and engine as
one flat state dict, and which of its tensors may be copied after the step returns.
"""
