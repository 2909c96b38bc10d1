"""The node-local cache of datasets on object storage: the `.idx` copy and the `.bin`'s
blocks, shared by the node's processes, within a budget."""
