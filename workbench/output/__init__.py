"""What conversions write: the output formats (safetensors, DCP), the destination lock."""
