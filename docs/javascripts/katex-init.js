// Renders the formulas that pymdownx.arithmatex leaves as \( ... \) and \[ ... \], on
// every page load (mkdocs-material's `document$` also fires on instant navigation).
// KaTeX (MIT, npm package `katex` 0.19.1) is vendored in ./katex: no CDN at view time.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    throwOnError: false,
  });
});
