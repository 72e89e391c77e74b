"""Training the tiny zoo on the CPU: recipes, batches, a resumable loop."""
