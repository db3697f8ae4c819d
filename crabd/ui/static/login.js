// Takes the token from the URL's fragment (never sent to a server, never in
// a log) or the form, keeps it for this tab and as a cookie for /ui's own
// files (a navigation cannot send a header), then opens the page.
'use strict';
(function () {
  function keep(tok) {
    sessionStorage.setItem('crabd_token', tok);
    document.cookie = 'crabd_token=' + encodeURIComponent(tok) + '; path=/ui; SameSite=Strict';
    location.replace('/ui/');
  }
  const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
  if (m) { keep(decodeURIComponent(m[1])); return; }
  document.getElementById('login').addEventListener('submit', function (e) {
    e.preventDefault();
    keep(document.getElementById('token').value.trim());
  });
})();
