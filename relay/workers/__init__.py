"""`relay serve --workers N`: worker processes on one listen address, one parent holding
what is relay-wide (parent, and holdings: what each worker holds of it), each worker a relay
whose shared state is the parent's (worker, through the stand-ins of remote), the messages
between them (wire), and the slot a keyed request asks for with its admission (ahead)."""
