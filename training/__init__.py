"""Training, apart from the services: the demo target (train-target), the drafter's distilled corpus
(distill-corpus) and the DFlash drafter (train-drafter), with the acceptance walk that evaluates it, and a small
pair embedded at a real architecture's shapes (embed-pair)."""
