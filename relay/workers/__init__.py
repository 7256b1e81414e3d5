"""`relay serve --workers N`: worker processes on one listen address, one parent holding
what is relay-wide (parent), each worker a relay whose shared state is the parent's (worker),
the messages between them (wire)."""
