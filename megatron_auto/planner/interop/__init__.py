"""Other planners' and trainers' formats: Galvatron 2.4's profile and plan files
(``galvatron``, ``galvatron_files``, ``galvatron_memory``) and classic Megatron-LM parallel flags
(``megatron_flags``)."""
