"""The ground floor: errors, bounded reads, readers of untrusted formats, system probes."""
