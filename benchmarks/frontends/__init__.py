"""The front ends' own tests and most-set features under the plugin (each needs a checkout or minutes CI has not)."""
