"""Secret sharer on a real pretrained model: canaries planted, fine-tuned in, steered out."""
