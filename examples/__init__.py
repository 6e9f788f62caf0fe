"""Examples of bringing your own task to Tandem (each folder has a README.md)."""
