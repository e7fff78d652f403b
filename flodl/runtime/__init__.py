"""Process-per-rank runtime: who starts processes, how ranks sync, and the controller between them.

Only this package spawns processes or reads rank environment variables (see ``env.py``).
"""
