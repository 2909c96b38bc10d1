"""The loader: `AsyncLoader`, its worker processes, the shared-memory batch slabs they fill,
and the page prefetch that reads coming samples ahead under a byte budget."""
