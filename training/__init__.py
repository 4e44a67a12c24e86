"""Training: the toy target's training script, and (to come) fit.py, the drafter LightningModule and export."""
