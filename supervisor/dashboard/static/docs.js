// The API docs page (/docs): Swagger UI, vendored, started from this file rather than from an
// inline script, so the page runs under the supervisor's Content-Security-Policy as it is.
"use strict";
(function () {
  var el = document.getElementById("swagger-ui");
  window.ui = SwaggerUIBundle({
    url: el.getAttribute("data-openapi-url"),
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    // Swagger UI would otherwise fetch a badge from a public validator: nothing leaves.
    validatorUrl: null,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
  });
})();
