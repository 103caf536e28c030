"""Gateway: owns the request and runs the rounds between drafter and verifier."""
