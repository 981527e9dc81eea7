"""What a steered model says at inference: per-token evidence (`explain`) and the reference
where a gate opens (`handoff`); above the artifacts they attach."""
